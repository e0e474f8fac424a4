/*
 * top: the swarm as text, from the daemon's "status" snapshot: once
 * (`hivemindctl status`) or live (`hivemindctl top`). top.c says how the
 * terminal is handled.
 */
#ifndef HM_CLI_TOP_H
#define HM_CLI_TOP_H

#include <jansson.h>
#include <stdio.h>

/* Writes the screen for snapshot st into f: lines of at most width
 * columns ending in "clear to end of line", at most rows lines (0: all),
 * the footer (may be NULL) on the last. */
void hm_top_render(FILE *f, const json_t *st, int width, int rows, const char *footer);

/* Runs the live view against the daemon at sock, refreshing every
 * interval_s seconds until q (or once, without touching the terminal).
 * Returns the exit status. */
int hm_top_run(const char *sock, double interval_s, int once);

#endif
