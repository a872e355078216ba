"""The algorithms: FedCG and the paper's baselines.

Plain TensorFlow in `*_tf.py` (`training_tf`: what every algorithm trains
with; `fedcg_tf`, `baselines_tf`: each algorithm's states and client and
server updates; `aggregators_tf`), federated placement in `*_tff.py`
(`round_tff`: the one round every algorithm runs; `fedcg_process_tff`,
`baselines_process_tff`: each algorithm's computations placed in it;
`aggregators_tff`), every algorithm by name in `catalog`.
"""
