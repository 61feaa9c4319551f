"""Labs 5 to 9 under nbgrader: the tests of test_nbgrader.py, on the later labs. A file of
their own, so that pytest-xdist (``--dist loadfile``) can run the two halves of the labs on
two workers at once."""

import pytest
from test_nbgrader import (  # noqa: F401 - pytest collects the imported tests here
    LATER,
    course_fixture,
    test_blank_submission_scores_zero_and_the_rest_runs,
    test_released_version_is_lsdl_students,
    test_source_version_scores_full_marks_with_every_cell_run,
    test_source_version_within_the_smoke_budget,
)

pytestmark = pytest.mark.notebook  # as test_nbgrader.py's (an imported test keeps no mark)

graded = course_fixture(LATER)
