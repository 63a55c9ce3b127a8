"""Entry point of a grammar compile process (``kvship.engine.grammar.compile_process``)."""

import sys

from kvship.engine.grammar.compile_process import child_main

if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]))
