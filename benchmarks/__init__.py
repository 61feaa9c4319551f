"""Side-by-side benchmarks of lsdl_lab against the references; see README.md."""
