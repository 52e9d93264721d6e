import sys

from tritone.openai.server import main

sys.exit(main())
