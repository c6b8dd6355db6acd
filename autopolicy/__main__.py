import sys

from autopolicy.cli import main

sys.exit(main())
