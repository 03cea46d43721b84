"""Rollout pools: vLLM workers of another Slurm job that join a running split, fully asynchronous run
(rollout.mode=fully_async, trainer.placement=split), generate beside its own engines, and leave.

    hpcrl submit --join RUN_DIR --rollout-nodes K     a job of K nodes, `hpcrl pool RUN_DIR` per task
    hpcrl pool RUN_DIR                                one pool worker in this process (what each task runs)
    hpcrl status RUN_DIR                              the run's pools, their workers and their state

- `wire`: the control channel (length-prefixed JSON over TCP; no pickle crosses it), the files in
  RUN_DIR/pools/ (controller.json: where the controller listens; token: the run's secret, mode 0600;
  state.json: the workers and their state) and the fingerprint a worker must share with the run.
- `registry` (the controller, MPI rank 0): accepts workers, hands each live one its share of every
  segment of the stream (hpcrl.trainer.stream), and declares one gone when its connection closes, it
  misses rollout.pool_liveness_s, or a weight load to it fails; its share of the segment in flight is
  answered with no tokens, so those samples simply go on in the next segment elsewhere and every prompt
  is still trained once.
- `weights`: the weights after each update, from trainer worker 0 to every pool worker over a gloo
  group of the two (torch.distributed over TCP, rendezvous at a TCPStore the controller hosts, not an
  MPI world): the same buckets and HF tensors the split placement sends its own engines
  (hpcrl.engines.transfer), whole (a pool worker runs rollout TP 1).
- `member` (a pool worker): reads RUN_DIR/pools/, says hello with the token and its fingerprint, builds
  its vLLM engine, loads the weights it is sent and serves segments until the run ends or it is killed.

A worker joins between steps: it gets the weights at the next update and its first segment after it.
"""
