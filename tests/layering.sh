#!/bin/sh
# The floors of the tree and which floors each may include. This table is
# the one place the layering is written down (docs/architecture.md shows it
# as a drawing). Data flows up: a file may include headers of its own floor
# and of the floors listed for it, never one above. averaging/ and moe/ sit
# side by side and do not include each other; lib/ and cuda/ stand on the
# base alone, so the trainer library and the GPU backend carry no node code.
#
# Also checked: every quoted include names its folder from the top of the
# tree ("src/net/rpc.h", "moe/proto.h"), except autoconf's "config.h", and
# the file it names exists. tests/, bench/ and contrib/ are above every floor
# and are checked for the folder rule only.
#
# Usage: tests/layering.sh [SRCDIR]   (exit 0 clean, 1 on a violation)
set -u
SRC="${1:-${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}}"
cd "$SRC" || exit 1

# floor: folder, then the floors it may include besides its own
LAYERS='
base      src/base
net       src/net     base
dht       dht         base net
node      src/node    base net dht
averaging averaging   base net dht node
moe       moe         base net dht node
daemon    src/daemon  base net dht node averaging moe
cli       src/cli     base lib
lib       lib         base
cuda      cuda        base
'

floor_of() { # path -> floor name ("" for tests, bench, contrib)
    echo "$LAYERS" | while read -r name dir _rest; do
        [ -n "$name" ] || continue
        case "$1" in "$dir"/*) echo "$name"; break ;; esac
    done
}
allowed() { # floor -> its own name and the floors below it
    echo "$LAYERS" | while read -r name _dir rest; do
        [ "$name" = "$1" ] && echo "$name $rest"
    done
}

bad=0
files="$(find src dht averaging moe lib cuda tests bench contrib \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) -type f | sort)"
for f in $files; do
    from="$(floor_of "$f")"
    ok="$( [ -n "$from" ] && allowed "$from")"
    grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
        sed 's/^\([0-9]*\):.*"\([^"]*\)".*/\1 \2/' > /tmp/hm-layering.$$ || true
    while read -r line inc; do
        [ "$inc" = "config.h" ] && continue
        case "$inc" in
            */*) ;;
            *) echo "$f:$line: include \"$inc\" does not name its folder"; bad=1; continue ;;
        esac
        if [ ! -f "$inc" ]; then
            echo "$f:$line: include \"$inc\" names no file from the top of the tree"
            bad=1; continue
        fi
        [ -n "$from" ] || continue
        to="$(floor_of "$inc")"
        if [ -z "$to" ]; then
            echo "$f:$line: floor $from includes \"$inc\", outside every floor"
            bad=1; continue
        fi
        case " $ok " in
            *" $to "*) ;;
            *) echo "$f:$line: floor $from includes \"$inc\" of floor $to (allowed: $ok)"
               bad=1 ;;
        esac
    done < /tmp/hm-layering.$$
    rm -f /tmp/hm-layering.$$
done
if [ "$bad" -ne 0 ]; then
    echo "layering: violations above; the allowed order is the table in tests/layering.sh"
    exit 1
fi
echo "layering: $(echo "$files" | wc -l) files, every include names its folder and none runs up a floor"
