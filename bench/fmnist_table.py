#!/usr/bin/python3
"""The accuracy table of bench/fmnist_modes.sh and bench/netlab_train.sh:
trainer 0's test accuracy at each mark (the last evaluation before it),
its steps and its rounds (done / failed), one row per mode, in Markdown.

    fmnist_table.py OUTDIR SECONDS N MODE...

reads OUTDIR/MODE.t0.log, the "t T step S acc A" and "done steps S rounds
R failed F" lines that bench/fmnist_modes.py prints.
"""
import re
import sys

NAMES = {
    "solo": "1 process",
    "periodic": "periodic averaging x{n}",
    "collab": "collaborative optimizer x{n}",
    "local": "collaborative, local updates x{n}",
    "diloco": "DiLoCo x{n}",
    "diloco-8bit": "DiLoCo, 8-bit x{n}",
}


def curve(path):
    pts, done = [], "-"
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return pts, done
    for line in lines:
        m = re.match(r"t ([0-9.]+) step (\d+) acc ([0-9.]+)", line)
        if m:
            pts.append((float(m.group(1)), int(m.group(2)), float(m.group(3))))
        m = re.match(r"done steps \d+ rounds (\d+) failed (\d+)", line)
        if m:
            done = "%s / %s" % m.groups()
    return pts, done


def at(pts, t):
    best = None
    for p in pts:
        if p[0] <= t + 0.5:
            best = p
    return "%.3f" % best[2] if best else "-"


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    out, secs, n, modes = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    marks = [m for m in (10, 20, 30, 45, 60, 90, 120, 180, 300) if m <= secs]
    print("| run (trainer 0) | " + " | ".join("%d s" % m for m in marks) +
          " | steps | rounds / failed |")
    print("| --- |" + " --- |" * (len(marks) + 2))
    for mode in modes:
        pts, done = curve("%s/%s.t0.log" % (out, mode))
        name = NAMES.get(mode, mode).format(n=n)
        print("| %s | %s | %d | %s |" % (name, " | ".join(at(pts, m) for m in marks),
                                         pts[-1][1] if pts else 0,
                                         done if mode != "solo" else "-"))


if __name__ == "__main__":
    main()
