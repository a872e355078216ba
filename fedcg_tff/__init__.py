"""fedcg-tff: FedCG (IJCAI 2022) in TensorFlow Federated."""
