"""python -m mhar_titan.compare runs/<pair>: see mhar_titan/compare/pair.py."""

import sys

from mhar_titan.compare.pair import main

if __name__ == "__main__":
    main(sys.argv[1:])
