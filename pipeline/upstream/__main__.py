import sys

from pipeline.upstream.refresh import main

sys.exit(main(sys.argv[1:]))
