import sys

from zoomkv.cli import main

sys.exit(main())
