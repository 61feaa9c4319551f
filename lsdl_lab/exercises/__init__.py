"""The labs' exercise checkers: a reference solution and test cases for each exercise.

A lab calls ``check.checker("lab01.top_k_accuracy")(top_k_accuracy)``; the checker runs
the student's function beside the reference (:func:`lsdl_lab.check.check_function`) on
every case and explains any difference. Cases are built from fixed seeds, so every student
sees the same ones. One module per lab; importing this package registers them all.
"""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
