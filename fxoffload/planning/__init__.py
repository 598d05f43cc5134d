"""Planning: pure functions from the analysis's data to a plan (one decision and reason per saved
tensor), the transfer schedule, and the budget fit."""
