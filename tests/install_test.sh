#!/usr/bin/env bash
# Installs a build into a scratch DESTDIR and checks what an installed
# hivemindd gives a user: the binaries, libhivemind with its header and
# pkg-config file (a program built with `pkg-config --cflags --libs
# libhivemind` links and runs), the systemd unit and the example config
# with this install's paths, the man pages, and the Python binding through
# pip.
#   tests/install_test.sh BUILDDIR
set -euo pipefail
BUILD="$(cd "${1:?usage: install_test.sh BUILDDIR}" && pwd)"
DEST="$(mktemp -d)"
trap 'rm -rf "$DEST"' EXIT
make -C "$BUILD" install DESTDIR="$DEST" prefix=/opt/hm >/dev/null
fail() { echo "install_test: $*" >&2; exit 1; }
for f in bin/hivemindd bin/hivemindctl include/hivemind.h lib/pkgconfig/libhivemind.pc \
         lib/systemd/system/hivemindd.service etc/hivemindd/hivemindd.conf.example \
         share/man/man8/hivemindd.8; do
    [ -e "$DEST/opt/hm/$f" ] || fail "make install did not install $f"
done
grep -q '^ExecStart=/opt/hm/bin/hivemindd -c /opt/hm/etc/hivemindd/hivemindd.conf ' \
    "$DEST/opt/hm/lib/systemd/system/hivemindd.service" || fail "the unit names other paths"
# The pc file names the prefix it was configured for; point it at DESTDIR.
sed -e "s|^prefix=.*|prefix=$DEST/opt/hm|" "$DEST/opt/hm/lib/pkgconfig/libhivemind.pc" \
    > "$DEST/libhivemind.pc"
cat > "$DEST/t.c" <<'C'
#include <hivemind.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
int main(void)
{
    hmc *h;
    char err[256];
    int r = hmc_connect("/nonexistent/hivemindd.sock", &h, err, sizeof(err));
    printf("%s %d\n", HMC_VERSION, r == -ENOENT);
    return 0;
}
C
CFLAGS_LIBS="$(PKG_CONFIG_PATH="$DEST" pkg-config --cflags --libs libhivemind)"
# shellcheck disable=SC2086
cc -o "$DEST/t" "$DEST/t.c" $CFLAGS_LIBS || fail "a program does not build with pkg-config"
OUT="$(LD_LIBRARY_PATH="$DEST/opt/hm/lib" "$DEST/t")"
VER="$(PKG_CONFIG_PATH="$DEST" pkg-config --modversion libhivemind)"
[ "$OUT" = "$VER 1" ] || fail "the installed library printed '$OUT', expected '$VER 1'"

# The Python binding installs with Debian's pip (offline: no build
# isolation, setuptools from Debian) and finds the installed libhivemind.
if /usr/bin/python3 -c 'import venv, setuptools, pip' 2>/dev/null; then
    SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cp -r "$SRC/contrib/python" "$DEST/pysrc"
    /usr/bin/python3 -m venv --system-site-packages "$DEST/venv"
    "$DEST/venv/bin/pip" install -q --no-build-isolation --no-index "$DEST/pysrc" \
        || fail "pip install ./contrib/python failed"
    PYV="$(cd / && LD_LIBRARY_PATH="$DEST/opt/hm/lib" "$DEST/venv/bin/python" -c \
        'import importlib.metadata as m, hivemindd, hivemindd._lib as L; L.lib(); print(m.version("hivemindd"), hivemindd.library_path())')"
    case "$PYV" in
        "$VER $DEST/opt/hm/lib/libhivemind.so"*|"$VER libhivemind.so"*) ;;
        *) fail "the pip-installed binding says '$PYV' (want version $VER and the installed library)" ;;
    esac
else
    echo "install_test: python3-venv, python3-pip or python3-setuptools missing: pip install not checked" >&2
fi
echo "install_test: ok ($VER under $DEST/opt/hm)"
