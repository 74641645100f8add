import sys

from bench.apps.gpu_suite.suite import main

sys.exit(main())
