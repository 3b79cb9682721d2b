import sys

from everystop.cli import main

sys.exit(main())
