"""What a run tells its user: metrics, TensorBoard, evals, progress lines, and the stop rules that watch them.

    reporter = Reporter.create(cfg.stop, steps=..., run_dir=..., fleet=..., ...)   # reporter.py
    reporter.log_step(step, rnd, trajs, taken, learn, phases, queue=..., verifier=...)

reporter.py writes a step's metrics (telemetry.py: the panels' keys from the step's samples, trajectories and
learner result; the progress line) to metrics.jsonl, TensorBoard and the tracking backends, runs the evals,
and feeds the stop rules (stop.py: the conditions that end a run with their exit codes).  The training loop
(train/) owns a Reporter; nothing here imports train/.
"""
