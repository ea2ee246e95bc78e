"""Sample production: where a learner's batches come from, between the rollout fleet and the training loop.

    source = RolloutSource(fleet, prompts, coordinator, scorer, spec=RoundSpec.from_sections(...))  # rollout_source.py
    rnd = source.next(step)      # a Round: samples (prompt-major groups), admission leases, stats

rollout_source.py owns the prompts (prompt_stream.py: the data cursor's order, encoded), the producer
(producer.py: rounds; stream_producer.py: groups streamed as they finish; their shared thread and admission
leases, producer_parts.py), dynamic sampling (dynamic_sampling.py) and the scoring of samples into
trajectories (scoring.py).  The training loop (train/) takes rounds from it; nothing here imports train/.
"""
