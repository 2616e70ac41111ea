import sys

from course.runner import main

sys.exit(main())
