"""`python -m locret.planner --measure JSON`: the child process of locret.planner.measure.measure (internal)."""
import sys

from .measure import main

sys.exit(main(sys.argv))
