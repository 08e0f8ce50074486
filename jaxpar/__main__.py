import sys

from jaxpar.cli import main

sys.exit(main())
