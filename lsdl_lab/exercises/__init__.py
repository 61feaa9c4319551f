"""The labs' exercise checkers: a reference solution and test cases for each exercise.

One module per lab, ``lsdl_lab.exercises.labNN``; importing it registers that lab's
checkers with :func:`lsdl_lab.check.exercise` under the names ``labNN.function``. A lab
imports its own module, then calls a checker by name::

    from lsdl_lab.exercises import lab01
    check.checker("lab01.top_k_accuracy")(top_k_accuracy)

The checker runs the student's function beside the reference
(:func:`lsdl_lab.check.check_function`) on every case and explains any difference.
Cases are built from fixed seeds, so every student sees the same ones. Importing this
package alone registers nothing: a lab pays only for its own checkers' imports.
"""
