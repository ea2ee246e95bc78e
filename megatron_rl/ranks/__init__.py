"""The learner ranks: one Ray actor per torch.distributed rank, driven in lock step by the training loop.

    group = LearnerGroup(RankSpec(...), placement=place.learner)   # group.py
    group.train_step(batch); group.publish(version); group.save(ckpt_dir)

group.py drives the ranks (a call on every rank, fail fast when one dies); rank.py is one rank
(`LearnerWorker`), assembled from build.py (the Megatron learner, its reference policy, its place in the
publication group) and weights.py (`WeightIO`: publication source, checkpoints, the audit's ring of
recent versions).  The training loop (train/policy.py) owns a group; nothing here imports train/.
"""
