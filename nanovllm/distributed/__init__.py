"""Beyond one machine, on torch.distributed (gloo on CPU, NCCL for the model's collectives on GPU).

  nodes.py      tensor parallelism over several nodes: node 0 runs the engine and its local ranks,
                every other node (`nanovllm serve MODEL --headless ...`, or run_headless) its own
                ranks; they meet at node 0's store (master_addr:master_port, or MASTER_ADDR /
                MASTER_PORT as torchrun sets them) and take each step's call by broadcast.
  pipeline.py   pipeline parallelism: PipelineRunner runs one stage's layers, micro-batch by
                micro-batch, hidden states passed point to point; stages.py: its groups, layer
                split, micro-batches and clock.
  options.py    Config's checks of the parallel options (tensor, pipeline, nodes); it imports
                nothing of nanovllm, so Config calls it with no import cycle.
  data_parallel.py  replicas of the whole engine, each a process, behind one front that the
                server calls (`nanovllm serve --data-parallel-size N`); router.py: which replica
                runs a prompt (by its prefix, or round robin).
  disaggregation.py  a prefill engine and a decode engine, each a process; the decode engine
                pulls each prompt's K/V over send/recv and serves them from its prefix cache.

Entered through engine/workers.py's start_workers (nnodes > 1) and make_group (stages.py), the
engine's choice of runner (pipeline_parallel_size > 1), Config's checks of the options (options.py) and the
server's choice of engine (data parallelism); a single-GPU engine imports none of it.
"""
