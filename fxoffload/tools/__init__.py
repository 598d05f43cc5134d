"""What people run on top of the backend: ``explain`` (the plan without training, and measured
steps), the command line and the demo."""
