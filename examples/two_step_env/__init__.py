"""A 2-step text environment of your own (README: "Your own task"), named by import path:
`data.env.name: two_step_env.env:TwoStep` (with this folder's parent on PYTHONPATH) or
`data.env.name: examples/two_step_env/env.py:TwoStep`."""
