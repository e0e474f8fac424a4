/*
 * test_config: the option table as a user meets it: defaults, the config
 * file (comments, case, repeated InitialPeers, errors that name the line),
 * flags overriding the file, and the printed configuration reading back to
 * the same configuration.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/helpers.h"
#include "src/base/paths.h"
#include "src/daemon/hm_config.h"
#include "src/base/util.h"

/* A syntactically valid peer id: 52 base32 characters. */
static void peer_addr(int seed, const char *hostport, char *out, size_t len)
{
    uint8_t pk[32];
    char id[64];
    for (size_t i = 0; i < sizeof(pk); i++)
        pk[i] = (uint8_t)(seed * 31 + (int)i);
    hm_base32_encode(pk, sizeof(pk), id, sizeof(id));
    snprintf(out, len, "%s@%s", id, hostport);
}

static int load(hm_config *c, const char *text, char *err, size_t errlen)
{
    hm_config_defaults(c);
    return hm_config_load_buffer(c, "test.conf", text, strlen(text), err, errlen);
}

/* Runs the parse-args step on a NULL-terminated list of arguments. */
static int args(hm_config_args *a, char *err, size_t errlen, char **argv)
{
    int argc = 0;
    while (argv[argc] != NULL)
        argc++;
    return hm_config_parse_args(argc, argv, a, err, errlen);
}

static void become_unprivileged(void)
{
    /* Each Criterion test runs in its own process, so this sticks to one test. */
    if (geteuid() == 0) {
        cr_assert_eq(setgid(65534), 0);
        cr_assert_eq(setuid(65534), 0);
    }
}

Test(config, defaults)
{
    hm_config c;
    char err[256];
    hm_config_defaults(&c);
    cr_assert_str_eq(c.listen, "0.0.0.0:31400");
    cr_assert_eq(c.n_initial_peers, 0);
    cr_assert_str_eq(c.control_socket_group, "");
    cr_assert_eq(c.control_max_clients, 32);
    cr_assert_eq(c.control_idle_timeout_s, 300);
    cr_assert_str_eq(c.swarm, "default");
    cr_assert_str_eq(c.swarm_key_file, "");
    cr_assert_eq(c.client_mode, 0);
    cr_assert_eq(c.log_level, HM_LOG_INFO);
    cr_assert_eq(c.ping_interval_s, 15);
    cr_assert_eq(c.max_connections, 512);
    cr_assert_str_eq(c.control_socket, "");
    cr_assert_eq(hm_config_finish(&c, err, sizeof(err)), 0, "%s", err);
    if (geteuid() == 0) {
        cr_assert_str_eq(c.state_dir, "/var/lib/hivemindd");
        cr_assert_str_eq(c.control_socket, "/run/hivemindd/control.sock");
    }
}

Test(config, unprivileged_defaults_follow_xdg)
{
    hm_config c;
    char err[256], buf[256];
    become_unprivileged();
    setenv("HOME", "/home/alice", 1);
    setenv("XDG_STATE_HOME", "/xdg/state", 1);
    setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
    hm_config_defaults(&c);
    cr_assert_eq(hm_config_finish(&c, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.state_dir, "/xdg/state/hivemindd");
    cr_assert_str_eq(c.control_socket, "/run/user/1000/hivemindd/control.sock");

    /* Without XDG variables: ~/.local/state and the socket in the state dir. */
    unsetenv("XDG_STATE_HOME");
    unsetenv("XDG_RUNTIME_DIR");
    hm_config_defaults(&c);
    cr_assert_eq(hm_config_finish(&c, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.state_dir, "/home/alice/.local/state/hivemindd");
    cr_assert_str_eq(c.control_socket, "/home/alice/.local/state/hivemindd/control.sock");

    /* The socket default follows a StateDir set in the file. */
    cr_assert_eq(load(&c, "StateDir /srv/hm\n", err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(hm_config_finish(&c, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.control_socket, "/srv/hm/control.sock");

    /* hivemindctl shares the rule. */
    cr_assert_eq(hm_paths_default_control_socket("/srv/hm", buf, sizeof(buf)), 0);
    cr_assert_str_eq(buf, "/srv/hm/control.sock");
}

Test(config, overlong_default_socket_path_is_reported)
{
    hm_config c;
    char err[256], dir[300];
    become_unprivileged();
    unsetenv("XDG_RUNTIME_DIR");
    memset(dir, 'd', sizeof(dir));
    dir[0] = '/';
    dir[200] = '\0';
    hm_config_defaults(&c);
    hm_strlcpy(c.state_dir, dir, sizeof(c.state_dir));
    cr_assert_eq(hm_config_finish(&c, err, sizeof(err)), -ENAMETOOLONG);
    cr_assert(strstr(err, "ControlSocket") != NULL, "%s", err);
}

Test(config, file_with_comments_case_and_repeated_peers)
{
    char p1[128], p2[128], p3[128], text[2048], err[256];
    hm_config c;
    peer_addr(1, "127.0.0.1:4000", p1, sizeof(p1));
    peer_addr(2, "[::1]:4001", p2, sizeof(p2));
    peer_addr(3, "10.0.0.3:4002", p3, sizeof(p3));
    snprintf(text, sizeof(text),
             "# a comment\n"
             "\n"
             "   # an indented comment\n"
             "LISTEN 127.0.0.1:0\n"
             "initialpeers %s\n"
             "InitialPeers %s, %s   # two more, with a comment\n"
             "\tswarm\tlab-1.b_c\r\n"
             "ClientMode true\n"
             "LogLevel DEBUG\n"
             "PingInterval 1\n"
             "maxconnections 64\n"
             "ControlMaxClients 4\n"
             "ControlIdleTimeout 0\n"
             "ControlSocket /tmp/x/ctl.sock\n"
             "ControlSocketGroup adm\n"
             "StateDir /tmp/x/state dir\n"
             "SwarmKeyFile /etc/hm/swarm.key\n"
             "Listen 127.0.0.1:5555", /* the last one wins; no final newline */
             p1, p2, p3);
    cr_assert_eq(load(&c, text, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.listen, "127.0.0.1:5555");
    cr_assert_eq(c.n_initial_peers, 3);
    cr_assert_str_eq(c.initial_peers[0], p1);
    cr_assert_str_eq(c.initial_peers[1], p2);
    cr_assert_str_eq(c.initial_peers[2], p3);
    cr_assert_str_eq(c.swarm, "lab-1.b_c");
    cr_assert_eq(c.client_mode, 1);
    cr_assert_eq(c.log_level, HM_LOG_DEBUG);
    cr_assert_eq(c.ping_interval_s, 1);
    cr_assert_eq(c.max_connections, 64);
    cr_assert_eq(c.control_max_clients, 4);
    cr_assert_eq(c.control_idle_timeout_s, 0);
    cr_assert_str_eq(c.control_socket, "/tmp/x/ctl.sock");
    cr_assert_str_eq(c.control_socket_group, "adm");
    cr_assert_str_eq(c.state_dir, "/tmp/x/state dir");
    cr_assert_str_eq(c.swarm_key_file, "/etc/hm/swarm.key");
}

Test(config, booleans)
{
    hm_config c;
    char err[256];
    const char *yes[] = {"yes", "true", "1", "on", "YES"};
    const char *no[] = {"no", "false", "0", "off", "No"};
    char line[64];
    for (size_t i = 0; i < 5; i++) {
        snprintf(line, sizeof(line), "ClientMode %s\n", yes[i]);
        cr_assert_eq(load(&c, line, err, sizeof(err)), 0, "%s", err);
        cr_assert_eq(c.client_mode, 1, "%s", yes[i]);
        snprintf(line, sizeof(line), "ClientMode yes\nClientMode %s\n", no[i]);
        cr_assert_eq(load(&c, line, err, sizeof(err)), 0, "%s", err);
        cr_assert_eq(c.client_mode, 0, "%s", no[i]);
    }
    cr_assert_eq(load(&c, "ClientMode maybe\n", err, sizeof(err)), -EINVAL);
}

struct bad_case {
    const char *text;
    const char *expect; /* must appear in the message */
};

Test(config, errors_name_file_and_line)
{
    static const struct bad_case cases[] = {
        {"Listen 127.0.0.1:1\n\nFrobnicate 3\n", "test.conf:3: unknown keyword 'Frobnicate'"},
        {"# c\nListen nowhere\n", "test.conf:2: bad value 'nowhere' for Listen"},
        {"Swarm ok\nPingInterval\n", "test.conf:2: missing value for PingInterval"},
        {"PingInterval 0\n", "test.conf:1: bad value '0' for PingInterval"},
        {"PingInterval 99999999999999999999\n", "test.conf:1: bad value"},
        {"PingInterval -1\n", "test.conf:1: bad value"},
        {"PingInterval 5s\n", "test.conf:1: bad value"},
        {"MaxConnections 0\n", "test.conf:1: bad value '0' for MaxConnections"},
        {"\n\n\n\nLogLevel loud\n", "test.conf:5: bad value 'loud' for LogLevel"},
        {"Swarm has space\n", "test.conf:1: bad value"},
        {"Swarm a/b\n", "test.conf:1: bad value"},
        {"Swarm "
         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
         "test.conf:1: bad value"},
        {"InitialPeers 127.0.0.1:5\n", "test.conf:1: bad value '127.0.0.1:5' for InitialPeers"},
        {"InitialPeers abc@127.0.0.1:5\n", "test.conf:1: bad value"},
        {"ControlSocketGroup wh/eel\n", "test.conf:1: bad value"},
        {"ClientMode\n", "test.conf:1: missing value for ClientMode"},
        /* A bad HOST:PORT blames the half that is wrong. */
        {"Listen 127.0.0.1:99999\n", "the port '99999' is not a number from 0 to 65535"},
        {"Listen [::1]:http\n", "the port 'http' is not a number"},
        {"Listen local_host:31400\n", "the host 'local_host' is neither an IPv4 or IPv6"},
        {"Listen -bad.example:1\n", "the host '-bad.example' is neither"},
        {"Announce localhost:0\n", "must be dialable: not port 0"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        hm_config c;
        char err[512] = "";
        cr_assert_eq(load(&c, cases[i].text, err, sizeof(err)), -EINVAL, "case %zu", i);
        cr_assert(strstr(err, cases[i].expect) != NULL, "case %zu: got \"%s\", want \"%s\"", i,
                  err, cases[i].expect);
    }
}

Test(config, overlong_line_and_nul_byte_name_their_line)
{
    hm_config c;
    char err[256];
    size_t n = 3 + HM_CONFIG_MAX_LINE + 20;
    char *text = malloc(n + 1);
    cr_assert_not_null(text);
    memcpy(text, "#\n\n", 3);
    memset(text + 3, 'x', n - 3);
    memcpy(text + 3, "StateDir /", 10);
    text[n] = '\0';
    cr_assert_eq(load(&c, text, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "test.conf:3: line too long") != NULL, "%s", err);
    free(text);

    /* A line of exactly the cap is fine. */
    text = malloc(HM_CONFIG_MAX_LINE + 2);
    cr_assert_not_null(text);
    memset(text, 'x', HM_CONFIG_MAX_LINE);
    memcpy(text, "StateDir /", 10);
    text[HM_CONFIG_MAX_LINE] = '\n';
    text[HM_CONFIG_MAX_LINE + 1] = '\0';
    hm_config_defaults(&c);
    int r = hm_config_load_buffer(&c, "test.conf", text, HM_CONFIG_MAX_LINE + 1, err,
                                  sizeof(err));
    /* It is too long for the StateDir field though, and says so. */
    cr_assert_eq(r, -EINVAL);
    cr_assert(strstr(err, "test.conf:1: bad value") != NULL, "%s", err);
    free(text);

    const char nul[] = "Swarm a\nSwarm b\0c\n";
    hm_config_defaults(&c);
    cr_assert_eq(hm_config_load_buffer(&c, "test.conf", nul, sizeof(nul) - 1, err, sizeof(err)),
                 -EINVAL);
    cr_assert(strstr(err, "test.conf:2: NUL byte") != NULL, "%s", err);
}

Test(config, file_errors)
{
    char dir[64], path[128], err[512];
    hm_config c;
    cr_assert_eq(hm_test_mkdtemp(dir, sizeof(dir), "cfg"), 0);

    snprintf(path, sizeof(path), "%s/missing.conf", dir);
    hm_config_defaults(&c);
    cr_assert_eq(hm_config_load_file(&c, path, err, sizeof(err)), -ENOENT);
    cr_assert(strstr(err, path) != NULL, "%s", err);

    /* Over the size cap: refused before parsing. */
    snprintf(path, sizeof(path), "%s/big.conf", dir);
    size_t n = HM_CONFIG_MAX_FILE + 1;
    char *big = malloc(n);
    cr_assert_not_null(big);
    memset(big, '\n', n);
    cr_assert_eq(hm_test_write_file(path, big, n, 0600), 0);
    free(big);
    cr_assert_eq(hm_config_load_file(&c, path, err, sizeof(err)), -EFBIG);
    cr_assert(strstr(err, "larger than") != NULL, "%s", err);

    snprintf(path, sizeof(path), "%s/bad.conf", dir);
    const char *text = "Listen 127.0.0.1:1\nBogus 1\n";
    cr_assert_eq(hm_test_write_file(path, text, strlen(text), 0600), 0);
    cr_assert_eq(hm_config_load_file(&c, path, err, sizeof(err)), -EINVAL);
    char want[200];
    snprintf(want, sizeof(want), "%s:2: unknown keyword 'Bogus'", path);
    cr_assert(strstr(err, want) != NULL, "%s", err);

    cr_assert_eq(hm_config_load_file(&c, dir, err, sizeof(err)), -EISDIR);
    hm_test_rmtree(dir);
}

Test(config, flags_override_file)
{
    char dir[64], path[128], err[512], p1[128], p2[128], p3[128], text[1024];
    hm_config c;
    hm_config_args a;
    cr_assert_eq(hm_test_mkdtemp(dir, sizeof(dir), "cfg"), 0);
    snprintf(path, sizeof(path), "%s/hivemindd.conf", dir);
    peer_addr(1, "127.0.0.1:1", p1, sizeof(p1));
    peer_addr(2, "127.0.0.1:2", p2, sizeof(p2));
    peer_addr(3, "127.0.0.1:3", p3, sizeof(p3));
    snprintf(text, sizeof(text),
             "Listen 127.0.0.1:7000\nSwarm fromfile\nInitialPeers %s\nLogLevel warn\n"
             "PingInterval 20\nClientMode yes\n",
             p1);
    cr_assert_eq(hm_test_write_file(path, text, strlen(text), 0600), 0);

    char peers_flag[300];
    snprintf(peers_flag, sizeof(peers_flag), "--initial-peers=%s", p2);
    char *argv[] = {"hivemindd", "-c", path, "--listen", "127.0.0.1:0", peers_flag,
                    "--initial-peers", p3, "--client-mode=no", "--ping-interval", "1", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), argv), 0, "%s", err);
    cr_assert_str_eq(a.config_file, path);
    cr_assert_eq(hm_config_build(&c, &a, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.listen, "127.0.0.1:0");
    cr_assert_str_eq(c.swarm, "fromfile"); /* not overridden */
    cr_assert_eq(c.log_level, HM_LOG_WARN);
    cr_assert_eq(c.ping_interval_s, 1);
    cr_assert_eq(c.client_mode, 0);
    /* The flags replace the file's peers rather than adding to them. */
    cr_assert_eq(c.n_initial_peers, 2);
    cr_assert_str_eq(c.initial_peers[0], p2);
    cr_assert_str_eq(c.initial_peers[1], p3);

    /* A bare boolean flag turns the option on. */
    char *argv2[] = {"hivemindd", "--client-mode", "-t", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), argv2), 0, "%s", err);
    cr_assert_eq(a.test_config, 1);
    cr_assert_eq(hm_config_build(&c, &a, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(c.client_mode, 1);
    hm_test_rmtree(dir);
}

Test(config, bad_flags_are_usage_errors)
{
    hm_config_args a;
    char err[512];
    char *unknown[] = {"hivemindd", "--frobnicate", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), unknown), -EINVAL);
    cr_assert(strstr(err, "unknown option '--frobnicate'") != NULL, "%s", err);

    char *unknown_short[] = {"hivemindd", "-x", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), unknown_short), -EINVAL);
    cr_assert(strstr(err, "unknown option '-x'") != NULL, "%s", err);

    char *bad[] = {"hivemindd", "--ping-interval", "soon", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), bad), -EINVAL);
    cr_assert(strstr(err, "--ping-interval") != NULL, "%s", err);

    char *missing[] = {"hivemindd", "--listen", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), missing), -EINVAL);
    cr_assert(strstr(err, "needs a value") != NULL, "%s", err);

    char *stray[] = {"hivemindd", "extra", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), stray), -EINVAL);
    cr_assert(strstr(err, "unexpected argument 'extra'") != NULL, "%s", err);

    char *noval[] = {"hivemindd", "--test-config=yes", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), noval), -EINVAL);
    cr_assert(strstr(err, "takes no value") != NULL, "%s", err);

    char *badpeer[] = {"hivemindd", "--initial-peers", "x@1.2.3.4:5", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), badpeer), -EINVAL);

    char *ok[] = {"hivemindd", "-V", "-h", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), ok), 0, "%s", err);
    cr_assert_eq(a.version, 1);
    cr_assert_eq(a.help, 1);
}

Test(config, printed_config_reads_back_the_same)
{
    char p1[128], p2[128], err[512];
    hm_config a, b;
    hm_config_defaults(&a);
    peer_addr(7, "127.0.0.1:31400", p1, sizeof(p1));
    peer_addr(8, "[2001:db8::1]:9", p2, sizeof(p2));
    hm_strlcpy(a.initial_peers[0], p1, sizeof(a.initial_peers[0]));
    hm_strlcpy(a.initial_peers[1], p2, sizeof(a.initial_peers[1]));
    a.n_initial_peers = 2;
    hm_strlcpy(a.listen, "[::1]:0", sizeof(a.listen));
    hm_strlcpy(a.state_dir, "/var/tmp/state with spaces", sizeof(a.state_dir));
    hm_strlcpy(a.control_socket_group, "wheel", sizeof(a.control_socket_group));
    hm_strlcpy(a.swarm, "My.Swarm-2", sizeof(a.swarm));
    a.client_mode = 1;
    a.log_level = HM_LOG_ERROR;
    a.ping_interval_s = 3600;
    a.control_idle_timeout_s = 0;
    cr_assert_eq(hm_config_finish(&a, err, sizeof(err)), 0, "%s", err);

    char *text = hm_config_format(&a);
    cr_assert_not_null(text);
    cr_assert(strstr(text, "InitialPeers ") != NULL);
    cr_assert(strstr(text, "# SwarmKeyFile (none)") != NULL, "%s", text);
    /* An unset option whose default is decided later quotes the default. */
    cr_assert(strstr(text, "# ExpertLearningRate (unset: default 0.001 for adam, 0.01 for sgd)") !=
                  NULL, "%s", text);
    /* Read back on top of different values, so that nothing passes by luck. */
    hm_config_defaults(&b);
    b.n_initial_peers = 0;
    hm_strlcpy(b.swarm, "other", sizeof(b.swarm));
    cr_assert_eq(hm_config_load_buffer(&b, "printed", text, strlen(text), err, sizeof(err)), 0,
                 "%s\n%s", err, text);
    cr_assert(hm_config_equal(&a, &b), "%s", text);
    free(text);

    /* And the defaults round-trip too. */
    hm_config_defaults(&a);
    cr_assert_eq(hm_config_finish(&a, err, sizeof(err)), 0, "%s", err);
    text = hm_config_format(&a);
    cr_assert_not_null(text);
    hm_config_defaults(&b);
    cr_assert_eq(hm_config_load_buffer(&b, "printed", text, strlen(text), err, sizeof(err)), 0,
                 "%s", err);
    cr_assert(hm_config_equal(&a, &b));
    free(text);
}

Test(config, values_that_cannot_round_trip_are_refused)
{
    hm_config_args a;
    char err[512];
    char *hash[] = {"hivemindd", "--state-dir", "/tmp/a #b", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), hash), -EINVAL);
    char *blank[] = {"hivemindd", "--state-dir", "/tmp/a ", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), blank), -EINVAL);
    char *ctrl[] = {"hivemindd", "--swarm-key-file", "/tmp/a\nListen 1.2.3.4:5", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), ctrl), -EINVAL);
    /* A '#' inside a word is kept. */
    char *ok[] = {"hivemindd", "--state-dir", "/tmp/a#b", NULL};
    cr_assert_eq(args(&a, err, sizeof(err), ok), 0, "%s", err);
}

Test(config, too_many_peers)
{
    hm_config c;
    char err[512], p[128];
    hm_strbuf b = {0};
    for (int i = 0; i < HM_CONFIG_MAX_PEERS + 1; i++) {
        peer_addr(i, "127.0.0.1:1", p, sizeof(p));
        hm_strbuf_printf(&b, "InitialPeers %s\n", p);
    }
    char *text = hm_strbuf_finish(&b);
    cr_assert_not_null(text);
    cr_assert_eq(load(&c, text, err, sizeof(err)), -EINVAL);
    char want[64];
    snprintf(want, sizeof(want), "test.conf:%d:", HM_CONFIG_MAX_PEERS + 1);
    cr_assert(strstr(err, want) != NULL, "%s", err);
    free(text);
}

Test(config, diff_tells_reloadable_options)
{
    hm_config a, b;
    char p[128];
    const char *kw[8];
    int rel[8];
    hm_config_defaults(&a);
    b = a;
    cr_assert(hm_config_equal(&a, &b));
    cr_assert_eq(hm_config_diff(&a, &b, kw, rel, 8), 0);
    b.log_level = HM_LOG_DEBUG;
    peer_addr(1, "127.0.0.1:1", p, sizeof(p));
    hm_strlcpy(b.initial_peers[0], p, sizeof(b.initial_peers[0]));
    b.n_initial_peers = 1;
    hm_strlcpy(b.listen, "127.0.0.1:1", sizeof(b.listen));
    cr_assert_not(hm_config_equal(&a, &b));
    size_t n = hm_config_diff(&a, &b, kw, rel, 8);
    cr_assert_eq(n, 3);
    int seen = 0;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(kw[i], "Listen") == 0) {
            cr_assert_eq(rel[i], 0);
            seen |= 1;
        } else if (strcmp(kw[i], "InitialPeers") == 0) {
            cr_assert_eq(rel[i], 1);
            seen |= 2;
        } else if (strcmp(kw[i], "LogLevel") == 0) {
            cr_assert_eq(rel[i], 1);
            seen |= 4;
        }
    }
    cr_assert_eq(seen, 7);
}

Test(config, make_dir_creates_private_directories)
{
    char dir[64], path[200], err[256];
    struct stat st;
    cr_assert_eq(hm_test_mkdtemp(dir, sizeof(dir), "cfg"), 0);
    snprintf(path, sizeof(path), "%s/a/b/c", dir);
    cr_assert_eq(hm_config_make_dir(path, 0700, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(stat(path, &st), 0);
    cr_assert(S_ISDIR(st.st_mode));
    cr_assert_eq(st.st_mode & 0777, 0700);
    /* Existing: fine. */
    cr_assert_eq(hm_config_make_dir(path, 0700, err, sizeof(err)), 0, "%s", err);
    /* A file in the way: a clear error. */
    snprintf(path, sizeof(path), "%s/file", dir);
    cr_assert_eq(hm_test_write_file(path, "x", 1, 0600), 0);
    cr_assert_eq(hm_config_make_dir(path, 0700, err, sizeof(err)), -ENOTDIR);
    cr_assert(strstr(err, "not a directory") != NULL, "%s", err);
    hm_test_rmtree(dir);
}

Test(config, usage_lists_every_flag)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_not_null(f);
    hm_config_usage(f, "hivemindd");
    fclose(f);
    const char *flags[] = {"--listen", "--initial-peers", "--state-dir", "--control-socket ",
                           "--control-socket-group", "--control-max-clients",
                           "--control-idle-timeout", "--swarm ", "--swarm-key-file",
                           "--client-mode", "--log-level", "--ping-interval",
                           "--max-connections", "--config", "--test-config", "--version",
                           "--help"};
    for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
        cr_assert(strstr(text, flags[i]) != NULL, "%s missing", flags[i]);
    free(text);
}

/* The averaging and state limits (docs/security.md): defaults, ranges and the donor list. */
Test(config, averaging_and_state_limits)
{
    hm_config c;
    char err[256];
    hm_config_defaults(&c);
    cr_assert_eq(c.average_weight_factor, 4);
    cr_assert_eq(c.average_clip_weight_factor, 1);
    cr_assert_eq(c.average_bandwidth_factor, 2);
    cr_assert_eq(c.state_donors_per_origin, 1);
    cr_assert_eq(c.state_max_step_lead, 0);
    cr_assert_str_empty(c.state_trusted_donors);
    cr_assert_eq(load(&c, "AverageWeightFactor 8\nAverageClipWeightFactor 2\n"
                               "AverageBandwidthFactor 3\nStateDonorsPerOrigin 2\n"
                               "StateMaxStepLead 5000\nStateTrustedDonors "
                               "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
                           err, sizeof(err)),
                 0, "%s", err);
    cr_assert_eq(c.average_weight_factor, 8);
    cr_assert_eq(c.average_clip_weight_factor, 2);
    cr_assert_eq(c.average_bandwidth_factor, 3);
    cr_assert_eq(c.state_donors_per_origin, 2);
    cr_assert_eq(c.state_max_step_lead, 5000);
    cr_assert_str_eq(c.state_trusted_donors,
                     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
    /* A factor under 1 would let a reducer scale honest weights to nothing. */
    cr_assert_neq(load(&c, "AverageWeightFactor 0\n", err, sizeof(err)), 0);
    cr_assert_neq(load(&c, "StateDonorsPerOrigin 0\n", err, sizeof(err)), 0);
    cr_assert_neq(load(&c, "StateTrustedDonors a b\n", err, sizeof(err)), 0);
}

/* -- early parts -- */
Test(config, average_early_parts_bounds)
{
    hm_config c;
    char err[256];
    hm_config_defaults(&c);
    cr_assert_eq(c.average_early_parts_mib, 64);
    cr_assert_eq(c.average_early_parts_origin_mib, 16);
    cr_assert_eq(load(&c, "AverageEarlyPartsMiB 0\nAverageEarlyPartsOriginMiB 4\n", err,
                      sizeof(err)),
                 0, "%s", err);
    cr_assert_eq(c.average_early_parts_mib, 0);
    cr_assert_eq(c.average_early_parts_origin_mib, 4);
    cr_assert_neq(load(&c, "AverageEarlyPartsMiB 70000\n", err, sizeof(err)), 0);
}

Test(config, host_names_are_kept_as_written_and_resolved_on_request)
{
    /* A name passes the syntax check and stays in the configuration as it
     * was written (so a reload compares like with like); hm_config_resolve
     * turns it into the address the node binds, dials and declares. */
    hm_config c;
    char err[512] = "", skipped[512], id[80], text[512];
    peer_addr(3, "localhost:4100", id, sizeof(id));
    snprintf(text, sizeof(text), "Listen localhost:4000\nAnnounce LocalHost:4001\n"
             "InitialPeers %s\n", id);
    cr_assert_eq(load(&c, text, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.listen, "localhost:4000");
    cr_assert_str_eq(c.announce, "LocalHost:4001");
    hm_config_addrs a;
    cr_assert_eq(hm_config_resolve(&c, &a, skipped, sizeof(skipped), err, sizeof(err)), 0, "%s",
                 err);
    cr_assert_str_eq(a.listen, "127.0.0.1:4000", "IPv4 before IPv6");
    cr_assert_str_eq(a.announce, "127.0.0.1:4001");
    cr_assert_eq(a.n_initial_peers, 1);
    cr_assert(strstr(a.initial_peers[0], "@127.0.0.1:4100") != NULL, "%s", a.initial_peers[0]);
    cr_assert_eq(strncmp(a.initial_peers[0], id, 53), 0, "the peer id is kept");
    cr_assert_str_eq(skipped, "");

    /* Numeric addresses pass through unchanged. */
    cr_assert_eq(load(&c, "Listen [::1]:7\n", err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(hm_config_resolve(&c, &a, skipped, sizeof(skipped), err, sizeof(err)), 0);
    cr_assert_str_eq(a.listen, "[::1]:7");
    cr_assert_str_eq(a.announce, "");

    /* A 254-octet name is over RFC 1035's bound. */
    char longname[300];
    memset(longname, 'a', sizeof(longname));
    for (int i = 63; i < 254; i += 64)
        longname[i] = '.';
    snprintf(longname + 254, sizeof(longname) - 254, ":1");
    char buf[320];
    snprintf(buf, sizeof(buf), "Listen %s\n", longname);
    cr_assert_eq(load(&c, buf, err, sizeof(err)), -EINVAL, "a 254-octet name is refused");
}

/* -- aead: StreamCipher -- */
Test(config, stream_cipher)
{
    hm_config c;
    char err[512] = "";
    hm_config_defaults(&c);
    cr_assert_str_eq(c.stream_cipher, "auto");
    static const char *const good[] = {"auto", "aes-256-gcm", "chacha20-poly1305"};
    for (size_t i = 0; i < 3; i++) {
        char text[64];
        snprintf(text, sizeof(text), "StreamCipher %s\n", good[i]);
        cr_assert_eq(load(&c, text, err, sizeof(err)), 0, "%s: %s", good[i], err);
        cr_assert_str_eq(c.stream_cipher, good[i]);
    }
    cr_assert_eq(load(&c, "\nStreamCipher aes-128-gcm\n", err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "test.conf:2: bad value 'aes-128-gcm' for StreamCipher") != NULL, "%s",
              err);
    cr_assert(strstr(err, "expected auto, aes-256-gcm or chacha20-poly1305") != NULL, "%s", err);
    /* It reads back from the printed configuration. */
    cr_assert_eq(load(&c, "StreamCipher chacha20-poly1305\n", err, sizeof(err)), 0);
    char *text = hm_config_format(&c);
    cr_assert(strstr(text, "StreamCipher chacha20-poly1305\n") != NULL, "%s", text);
    free(text);
}

/* -- relay -- */
Test(config, relay_options)
{
    hm_config c;
    char err[512] = "", a[128], b[128], text[1024];
    cr_assert_eq(load(&c, "", err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(c.relay, 0);
    cr_assert_str_eq(c.relay_via, "");
    cr_assert_eq(c.relay_max_reservations, 128);
    cr_assert_eq(c.relay_reservations_per_origin, 4);
    cr_assert_eq(c.relay_max_circuits, 64);
    cr_assert_eq(c.relay_circuits_per_origin, 8);
    cr_assert_eq(c.relay_max_mib, 256);
    cr_assert_eq(c.relay_rate_kib, 16384);
    cr_assert_eq(c.relay_circuit_lifetime_s, 3600);
    peer_addr(1, "203.0.113.7:31400", a, sizeof(a));
    peer_addr(2, "[2001:db8::1]:31400", b, sizeof(b));
    snprintf(text, sizeof(text), "Relay yes\nRelayVia %s,%s\nRelayCircuitsPerOrigin 2\n", a, b);
    cr_assert_eq(load(&c, text, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(c.relay, 1);
    snprintf(text, sizeof(text), "%s,%s", a, b);
    cr_assert_str_eq(c.relay_via, text);
    cr_assert_eq(c.relay_circuits_per_origin, 2);

    const char *bad[] = {"RelayVia 203.0.113.7:31400\n", "RelayVia %s,\n", "RelayVia %s,,%s\n",
                         "RelayVia %s;rm\n", "RelayMaxCircuits 0\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text), bad[i], a, a);
        cr_assert_eq(load(&c, text, err, sizeof(err)), -EINVAL, "case %zu: %s", i, text);
        cr_assert(strstr(err, "test.conf:1: bad value") != NULL, "case %zu: %s", i, err);
    }
    /* At most 8 relays. */
    char many[2048] = "RelayVia ";
    for (int i = 0; i < 9; i++) {
        peer_addr(10 + i, "203.0.113.9:31400", a, sizeof(a));
        strcat(many, a);
        strcat(many, i < 8 ? "," : "\n");
    }
    cr_assert_eq(load(&c, many, err, sizeof(err)), -EINVAL);
}

/* -- netlab -- */
Test(config, test_delay_rules)
{
    hm_config c;
    char err[512] = "";
    cr_assert_eq(load(&c, "", err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.test_delay, "");
    cr_assert_eq(load(&c, "TestDelay 10.77.1.0/24=100,10.77.1.3=10,fd00::/8=5\n", err,
                      sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.test_delay, "10.77.1.0/24=100,10.77.1.3=10,fd00::/8=5");
    char *text = hm_config_format(&c);
    cr_assert(strstr(text, "TestDelay 10.77.1.0/24=100,10.77.1.3=10,fd00::/8=5\n") != NULL, "%s",
              text);
    free(text);
    cr_assert_eq(load(&c, "\nTestDelay 10.77.1.0/33=1\n", err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "test.conf:2: bad value") != NULL, "%s", err);
    cr_assert(strstr(err, "longer than the address") != NULL, "%s", err);
    cr_assert_eq(load(&c, "TestDelay 10.77.1.2=20000\n", err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "0 to 10000 ms") != NULL, "%s", err);
}

/* -- status grids -- */
Test(config, status_grids_take_utf8_grid_names)
{
    hm_config c;
    char err[256];
    /* Grid names as expert uids allow them: UTF-8, Hivemind's trailing dot. */
    cr_assert_eq(load(&c, "StatusGrids ffn,\xc3\xa9tage.,\xe4\xb8\x93\xe5\xae\xb6_1,a-b:c\n", err,
                      sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(c.status_grids, "ffn,\xc3\xa9tage.,\xe4\xb8\x93\xe5\xae\xb6_1,a-b:c");
    static const struct bad_case cases[] = {
        {"StatusGrids ffn.3.\n", "sub-grid"},
        {"StatusGrids ffn,,x\n", "1 to 8 grid names"},
        {"StatusGrids ffn,\n", "trailing comma"},
        {"StatusGrids .\n", "empty grid name"},
        {"StatusGrids a,b,c,d,e,f,g,h,i\n", "1 to 8 grid names"},
        {"StatusGrids bad\xc3(\n", "not UTF-8"},
        {"StatusGrids over\xc0\xaflong\n", "not UTF-8"},
        {"StatusGrids c1\xc2\x85x\n", "control character"},
        {"StatusGrids 0123456789012345678901234567890123456789012345678901234567890123\n",
         "63 bytes"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cr_assert_eq(load(&c, cases[i].text, err, sizeof(err)), -EINVAL, "%s", cases[i].text);
        cr_assert(strstr(err, cases[i].expect) != NULL, "'%s': got '%s'", cases[i].text, err);
    }
}
