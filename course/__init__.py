"""The hfstream course: eleven graded lessons from a single-stream baseline to data parallelism across the step boundary.

In a notebook: ``check("05.overlap_hook")``. From a shell: ``python -m course start|grade|progress|build``.
"""

from course.grading import check
from course.lib import setup_notebook

__all__ = ["check", "setup_notebook"]
