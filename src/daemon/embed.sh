#!/bin/sh
# embed.sh NAME FILE: writes C source defining the bytes of FILE as
# `const char NAME[]` (NUL-terminated) and `const size_t NAME_len`, so that
# a file (the swarm page) is built into the program; od is POSIX.
set -e
name=$1
file=$2
printf '/* Generated from %s by embed.sh; do not edit. */\n#include <stddef.h>\n' "$file"
printf 'const char %s[] = {\n' "$name"
od -An -v -tx1 "$file" | sed -e 's/  */ /g' -e 's/^ //' -e '/^$/d' -e 's/\([0-9a-f][0-9a-f]\)/0x\1,/g'
printf '0x00};\nconst size_t %s_len = sizeof(%s) - 1;\n' "$name" "$name"
