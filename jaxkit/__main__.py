import sys

from jaxkit.cli import main

sys.exit(main())
