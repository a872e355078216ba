"""Hyper-parameters of FedCG and the baselines, with the published code's
defaults.

One frozen object is handed to every builder, so the TensorFlow layer, the TFF
layer and the binaries cannot disagree about a value. Field names are the
binaries' flag names, so a validation error names the flag to fix.
"""

import dataclasses
import math

DISTANCES = ('mse', 'cos', 'none')
CLIENT_OPTIMIZERS = ('adam', 'sgd')
# Where the clients' initial networks come from (FedCGConfig.client_init).
CLIENT_INITS = ('shared', 'private')
# The networks `client_init='private'` draws from each client's own seed:
# those that never leave the client (its extractor E_i and discriminator
# D_i). Shared networks (C, G) always start from the run's seed, as the
# server's copies do.
PRIVATE_NETWORKS = ('extractor', 'discriminator')
# Seeds go into numpy and TensorFlow seeds and into per-client seeds
# (driver.client_seeds): kept to a range every one of them takes.
MAX_SEED = 2**31 - 1
MODELS = ('lenet', 'resnet18')  # models.families.MODELS, without TF.
# FedCGConfig.matmul_precision.
MATMUL_PRECISIONS = ('float32', 'bfloat16')


@dataclasses.dataclass(frozen=True)
class FedCGConfig:
  """Hyper-parameters of FedCG (FEDCG_SPEC.md, 'Defaults of the published code')."""

  num_classes: int = 10
  image_channels: int = 1
  # Network family: 'lenet' (32x32 inputs) or 'resnet18' (224x224).
  model: str = 'lenet'
  noise_dim: int = 100
  batch_size: int = 8
  lr: float = 3e-4
  weight_decay: float = 1e-4
  # Adam betas: the classification network uses PyTorch's defaults, the GAN
  # pair DCGAN's (0.5, 0.999); the server's distillation uses the defaults.
  beta1: float = 0.9
  beta2: float = 0.999
  gan_beta1: float = 0.5
  gan_beta2: float = 0.999
  # PyTorch's default value. TFF's Adam adds it to sqrt(v) before the bias
  # correction rather than after: in PyTorch's form it is eps /
  # sqrt(1 - beta2^t) (3e-7 at step 1, near 1e-8 after a few thousand), a
  # negligible difference.
  adam_epsilon: float = 1e-8
  local_epochs: int = 20
  gan_epochs: int = 20
  server_epochs: int = 20
  server_steps_per_epoch: int = 100
  distance: str = 'mse'
  # The gamma ramp reaches ~1 after this many rounds: p = min(round / n, 1).
  gamma_ramp_rounds: int = 50
  seed: int = 1
  # 'shared' (the published code): every client's E, C and D and the
  # server's G and C are one draw from `seed`, so all clients start from the
  # same networks and the server knows each client's initial E. 'private':
  # each client draws its E and D from its own seed, as a deployment would
  # that keeps E_i from the server from the start.
  client_init: str = 'shared'
  # Optimizer of E and C on the clients (every algorithm). The published code
  # uses Adam; 'sgd' (plain, no momentum) is what tff.learning's FedAvg runs.
  client_optimizer: str = 'adam'
  # FedProx: weight of (mu / 2) * ||w - w_global||^2 in the local loss.
  prox_mu: float = 0.01
  # FedGen: weight of the diversity term in the server generator's loss.
  diversity_weight: float = 1.0
  # True: every round replays the first round's random draws (training data
  # order and flips, the clients' and the server's noise), and every client
  # draws what the others draw, as the published code does: it reseeds its
  # generators with the run's seed at the start of each client's training
  # and of the server's distillation, every round. False (the default):
  # fresh draws each round and per client (`training_tf.draw_key`). Client
  # sampling and DP noise stay fresh either way (the original has neither;
  # the DP accounting assumes independent noise each round).
  replay_draws: bool = False
  # 'float32' (the default): every product in float32. 'bfloat16', an
  # opt-in for hosts with bfloat16 arithmetic (AVX512-BF16 or AMX): oneDNN
  # rounds the inputs of the GAN's products and of E's convolutions (its
  # primitives; dense layers stay float32) to bfloat16 and accumulates in
  # float32 (`small_conv.matmul`, `execution.precision`); results differ
  # from float32 runs by more than float rounding (README, "bfloat16
  # products": its speed, and its accuracy once measured).
  matmul_precision: str = 'float32'

  @property
  def image_size(self) -> int:
    """The side of the square images the extractor takes."""
    return 32 if self.model == 'lenet' else 224  # models.image_size

  @property
  def distill_steps(self) -> int:
    return self.server_epochs * self.server_steps_per_epoch

  @property
  def distill_samples(self) -> int:
    return self.distill_steps * self.batch_size

  def validate(self) -> 'FedCGConfig':
    """Raises ValueError naming the first invalid field; returns self."""
    positive_ints = ('num_classes', 'image_channels', 'noise_dim', 'batch_size',
                     'local_epochs', 'gan_epochs', 'server_epochs',
                     'server_steps_per_epoch', 'gamma_ramp_rounds')
    for name in positive_ints:
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be >= 1, got {getattr(self, name)}')
    for name in ('lr', 'adam_epsilon'):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f'{name} must be finite and > 0, got {value}')
    for name in ('weight_decay', 'prox_mu', 'diversity_weight'):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f'{name} must be finite and >= 0, got {value}')
    if not 0 <= self.seed <= MAX_SEED:
      raise ValueError(f'seed must be in [0, {MAX_SEED}], got {self.seed}')
    for name in ('beta1', 'beta2', 'gan_beta1', 'gan_beta2'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f'{name} must be in [0, 1), got {getattr(self, name)}')
    if self.client_optimizer not in CLIENT_OPTIMIZERS:
      raise ValueError(f'client_optimizer must be one of {CLIENT_OPTIMIZERS}, '
                       f'got {self.client_optimizer!r}')
    if self.client_init not in CLIENT_INITS:
      raise ValueError(f'client_init must be one of {CLIENT_INITS}, '
                       f'got {self.client_init!r}')
    if self.model not in MODELS:
      raise ValueError(f'model must be one of {MODELS}, got {self.model!r}')
    if self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f'matmul_precision must be one of {MATMUL_PRECISIONS}, '
                       f'got {self.matmul_precision!r}')
    if self.distance not in DISTANCES:
      raise ValueError(
          f'distance must be one of {DISTANCES}, got {self.distance!r}')
    return self
