"""python -m mhar_titan.eval runs/<pair> --tasks ...: see mhar_titan/eval/pair.py."""

import sys

from mhar_titan.eval.pair import main

if __name__ == "__main__":
    main(sys.argv[1:])
