import sys

from inventory.cli import main

sys.exit(main())
