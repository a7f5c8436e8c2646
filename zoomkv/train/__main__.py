"""``python -m zoomkv.train --recipe recipes/...yaml [key=value ...]`` (also under ``accelerate launch -m``)."""

import sys

from zoomkv.train.cli import main

sys.exit(main())
