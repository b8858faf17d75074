"""python -m mhar_titan.preflight CONTROL.toml MHAR.toml [options] [--section.key value ...]"""

from mhar_titan.preflight.cli import main

if __name__ == "__main__":
    main()
