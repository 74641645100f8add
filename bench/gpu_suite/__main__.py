import sys

from bench.gpu_suite.suite import main

sys.exit(main())
