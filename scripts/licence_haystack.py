"""Write a haystack of legal prose for ``zoomkv eval --haystack``: ten licence texts as Debian ships them, one file.

RULER's essay tasks run on the King James Bible by default and the quickstart recipe trains on Python's docs; the
licences are a third kind of prose, which neither saw. In this order they give the words the licence rows of
BENCHMARKS.md ran on (``scripts/benchmarks.py``'s ``licences`` step).

    python scripts/licence_haystack.py runs/benchmarks/licences.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoomkv.atomic import write_file_atomically  # noqa: E402

LICENCES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-1.1", "MPL-2.0")
SOURCE = Path("/usr/share/common-licenses")  # Debian's base-files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the text file to write")
    p.add_argument("--source", type=Path, default=SOURCE, help="the folder holding the licence texts")
    args = p.parse_args(argv)
    missing = [name for name in LICENCES if not (args.source / name).is_file()]
    if missing:
        print(f"licence_haystack: {args.source} lacks {', '.join(missing)} (Debian's base-files ships them)",
              file=sys.stderr)
        return 2
    text = "".join((args.source / name).read_text(encoding="utf-8") for name in LICENCES)
    if args.out.exists():  # another file of that name is not this script's to replace
        if args.out.is_file() and args.out.read_text(encoding="utf-8", errors="replace") == text:
            print(f"{args.out} holds the haystack already")
            return 0
        print(f"licence_haystack: {args.out} exists and is not this haystack; name another file", file=sys.stderr)
        return 2
    write_file_atomically(args.out, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
