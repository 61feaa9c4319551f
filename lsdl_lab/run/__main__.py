"""``python -m lsdl_lab.run [--config FILE.yaml] [--option value ...]``, alone or under
``torchrun``; ``--help`` lists every option."""

import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
