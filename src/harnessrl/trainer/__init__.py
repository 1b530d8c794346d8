"""trainer: turns graded rollouts into PPO updates of the model the engine serves.

Modules: `loop` (the sync schedule: rollouts → batch → update → publish weights; TrainContext), `async_loop`
(the collocated async schedule), `ppo` (the PPO-clip update over micro-batches, exact for any split),
`forward` (logprobs of selected positions, shared prefixes, chunked head, activation checkpointing),
`weights` (publishing weights to the engine), `checkpoint` (save/restore of the whole training state),
`metrics` (metrics.jsonl, TensorBoard, strict JSON).
"""
