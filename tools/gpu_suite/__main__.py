import sys

from tools.gpu_suite.suite import main

sys.exit(main())
