"""Adam inside training loops: TF's fused kernel gives what
`tff.learning.optimizers`' functional Adam gives, bit for bit, and updates
no weight the step still reads. PartyNetworks
builds only the networks asked for; InitialNetworks draws what they draw
without building them in the caller's graph."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import round_tff
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import model_weights


def _functional(optimizer, nets, variables, weight_decay=0.0):
  del nets
  return training_tf.FunctionalSteps(optimizer, list(variables), weight_decay)


def _leaves(structure):
  return [np.asarray(t) for t in tf.nest.flatten(structure)]


def test_frozen_network_chunks_hold_512_examples_of_known_size_only():
  spec = lambda shape: tf.data.Dataset.from_tensor_slices(
      (tf.zeros([1, *shape]), tf.zeros([1], tf.int32))).batch(8)
  assert training_tf.batches_per_chunk(spec([32, 32, 1]), 8) == 64
  assert training_tf.batches_per_chunk(spec([32, 32, 1]), 32) == 16
  # 8 MB of images at most: ResNet-18's inputs stay at a batch a call.
  assert training_tf.batches_per_chunk(spec([224, 224, 3]), 8) == 1
  assert training_tf.batches_per_chunk(spec([64, 64, 3]), 8) == 21  # 170.
  fixed = tf.data.Dataset.from_tensor_slices(
      (tf.zeros([8, 32, 32, 1]), tf.zeros([8], tf.int32))).batch(
          8, drop_remainder=True)
  assert training_tf.batches_per_chunk(fixed, 8) == 1
  # What a round's clients read is chunked: the batches TFF's type gives a
  # worker, as the clients' pipelines make them (their shape, not data).
  images = round_tff.batch_type(FedCGConfig())[0]
  assert images.shape == (None, 32, 32, 1)
  assert training_tf.batches_per_chunk(spec(images.shape[1:]), 8) == 64


@pytest.mark.parametrize('chunk_examples,calls_per_epoch', [
    (8, 7), (16, 4), (512, 1)])
def test_frozen_network_runs_once_a_chunk(chunk_examples, calls_per_epoch,
                                          monkeypatch):
  """The network of a FrozenNetworkLoss runs once for each chunk of an
  epoch (52 examples in 7 batches of 8), once a step below two batches;
  the equality tests (fedcg_tf_test) cannot see a loop that silently runs
  it once a step."""
  monkeypatch.setattr(training_tf, 'FROZEN_CHUNK_EXAMPLES', chunk_examples)
  config = FedCGConfig(batch_size=8)
  nets = training_tf.PartyNetworks(config, ('extractor', 'classifier'))
  calls = tf.Variable(0)
  rows = tf.Variable(0)

  def network(draws, labels):
    del labels
    calls.assign_add(1)
    rows.assign_add(tf.shape(draws)[0])
    return draws

  loss = training_tf.FrozenNetworkLoss(
      draws=lambda labels, step: tf.fill([tf.shape(labels)[0]], step),
      network=network,
      loss=lambda features, labels, draws, outputs: tf.cast(
          tf.reduce_sum(outputs - draws), tf.float32))
  dataset = tf.data.Dataset.from_tensor_slices(
      (tf.zeros([52, 32, 32, 1]), tf.zeros([52], tf.int32))).batch(8)
  state = training_tf.classification_optimizer(config).initialize(
      [tf.TensorSpec(v.shape, v.dtype) for v in
       nets.extractor.trainable_variables +
       nets.classifier.trainable_variables])
  _, _, extra = tf.function(lambda: training_tf.train_classifier(
      nets, state, dataset, 2, loss))()
  assert int(calls.numpy()) == 2 * calls_per_epoch
  assert int(rows.numpy()) == 2 * 52
  assert float(extra) == 0.0  # Each step saw its own draws' outputs.


def test_networks_builds_only_the_named_networks():
  nets = training_tf.PartyNetworks(FedCGConfig(), ('classifier', 'extractor'))
  assert nets.extractor.name == 'extractor'
  assert nets.model('classifier').name == 'classifier'
  with pytest.raises(AttributeError, match='without the generator'):
    nets.generator  # pylint: disable=pointless-statement
  # Moments exist for the built networks' weights only.
  assert len(nets._moments) == len(nets.extractor.trainable_variables +
                                   nets.classifier.trainable_variables)
  with pytest.raises(ValueError, match='encoder'):
    training_tf.PartyNetworks(FedCGConfig(), ('encoder',))
  with pytest.raises(TypeError, match='sequence of names'):
    training_tf.PartyNetworks(FedCGConfig(), 'extractor')


@pytest.mark.parametrize('model,names', [
    ('lenet', training_tf.NETWORK_NAMES),
    ('resnet18', ('extractor', 'classifier'))])  # ResNet's own E and C.
def test_initial_networks_draw_what_networks_built_in_the_graph_draw(
    model, names):
  """InitialNetworks (templates built once, outside the computation's graph)
  give the draws of networks built in it, bit for bit: the server's draw
  and a client's under private init (its own seed for E and D, the run's
  for C and G), with templates built while tracing and built eagerly; and
  the same weight specs."""
  config = FedCGConfig(model=model, image_channels=3 if model == 'resnet18'
                       else 1, client_init='private', seed=4)
  with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    built = training_tf.PartyNetworks(config, names)
    initial = training_tf.InitialNetworks(config, names)
    client = tf.constant(11, tf.int64)
    draws = {}
    for name in names:
      own = 11 if name in ('extractor', 'discriminator') else config.seed
      draws[name] = (
          (model_weights.sample_initial(built.model(name),
                                        tf.constant(config.seed, tf.int64)),
           initial.initial_weights(name)),
          (model_weights.sample_initial(built.model(name),
                                        tf.constant(own, tf.int64)),
           initial.initial_weights(name, client)))
      assert [(v.shape, v.dtype) for v in
              initial.model(name).trainable_weights] == [
                  (v.shape, v.dtype)
                  for v in built.model(name).trainable_weights]
      assert [(z.shape, z.dtype) for z in initial.zeros(name)] == [
          (v.shape, v.dtype) for v in built.model(name).weights]
    values = session.run(draws)
  for name, pairs in values.items():
    for in_graph, from_template in pairs:
      assert len(in_graph) == len(from_template) > 0
      for a, b in zip(in_graph, from_template):
        np.testing.assert_array_equal(a, b, err_msg=name)
  with pytest.raises(AttributeError, match='hold no generator'):
    training_tf.InitialNetworks(config, ('extractor',)).zeros('generator')
  # What makes it cheap: no network (no variable) in the caller's graph,
  # also when the templates are built during the call (cache emptied).
  training_tf._template.cache_clear()  # pylint: disable=protected-access
  with tf.Graph().as_default() as graph:
    initial = training_tf.InitialNetworks(config, names)
    for name in names:
      initial.initial_weights(name)
      initial.zeros(name)
    assert not [op for op in graph.get_operations()
                if op.type in ('VarHandleOp', 'VariableV2')]
  # Eagerly, templates are built eagerly: the same draws, and a network made
  # before stays usable (Keras invalidates it if a network is then built in
  # a graph).
  training_tf._template.cache_clear()  # pylint: disable=protected-access
  before = training_tf.PartyNetworks(config, names[:1])
  initial = training_tf.InitialNetworks(config, names)
  for name in names:
    for (in_graph, _), eager in zip(values[name], (
        initial.initial_weights(name),
        initial.initial_weights(name, tf.constant(11, tf.int64)))):
      for a, b in zip(in_graph, eager, strict=True):
        np.testing.assert_array_equal(a, b.numpy(), err_msg=name)
  inputs = tf.zeros([1, *before.model(names[0]).input_shape[1:]])
  before.model(names[0])(inputs, training=False)


@pytest.mark.parametrize('weight_decay', [0.0, 1e-2])
def test_fused_adam_steps_equal_functional_adam(weight_decay):
  config = FedCGConfig()
  nets = training_tf.PartyNetworks(config)
  variables = nets.classifier.trainable_variables
  start = [v.numpy() for v in variables]
  rng = np.random.default_rng(0)
  # Gradients over many magnitudes, some exactly zero.
  grads = [tuple(tf.constant(
      (rng.normal(size=v.shape) * 10.0 ** rng.uniform(-6, 2, size=v.shape) *
       (rng.random(v.shape) > 0.1)).astype(np.float32)) for v in variables)
           for _ in range(6)]
  optimizer = training_tf.classification_optimizer(config)
  state = training_tf.initial_optimizer_state(optimizer, variables)

  def run(steps_fn, state):
    for v, s in zip(variables, start):
      v.assign(s)

    @tf.function
    def loop(state):
      steps = steps_fn(optimizer, nets, variables, weight_decay)
      carry = steps.begin(state)
      for g in grads:
        carry = steps.step(carry, g)
      return steps.end(carry)

    # Twice: the second call starts from the first's optimizer state.
    state_out = loop(loop(state))
    return _leaves(state_out), [v.numpy() for v in variables]

  # Start from moments that are not those the fused path last left in its
  # variables (zeros): they must be loaded from the state.
  warm = run(_functional, state)[0]
  warm = tf.nest.pack_sequence_as(state, warm)
  fused = run(training_tf.optimizer_steps, warm)
  assert isinstance(training_tf.optimizer_steps(optimizer, nets, variables),
                    training_tf.FusedAdamSteps)
  functional = run(_functional, warm)
  for a, b in zip(fused[0] + fused[1], functional[0] + functional[1]):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(fused[1][0], start[0])  # The steps did move.


def _gan_epoch():
  """One stage-2 epoch (5 steps) from fixed networks and optimizer states:
  its outputs and the networks' weights after it, as numpy leaves."""
  config = FedCGConfig(gan_epochs=1)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(40, 32, 32, 1)).astype(np.float32)
  y = rng.integers(0, 10, 40).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  state = fedcg_tf.initial_client_state(config, 1)
  nets = fedcg_tf.PartyNetworks(config)
  for name in ('extractor', 'generator', 'discriminator'):
    model_weights.assign(nets.model(name), model_weights.sample_initial(
        nets.model(name), tf.constant(5, tf.int64)))
  out = tf.function(lambda: fedcg_tf.train_gan(
      nets, state.discriminator_optimizer, state.generator_optimizer,
      dataset, state.seed, 0))()
  return _leaves(out) + _leaves(
      [model_weights.values(nets.model(n))
       for n in ('extractor', 'generator', 'discriminator')])


def test_gan_epoch_kernels_keep_its_results(monkeypatch):
  """Stage 2 with its fast kernels against the plain computation. Fused Adam
  (ResourceApplyAdam) reads D after updating it within a step: the in-place
  update must keep that order, bit for bit. D's real and fake passes as one
  stacked call (layers.paired_passes) give the same results to float
  rounding: losses, every weight, BN statistics and spectral-norm vectors
  after five steps."""
  fast = _gan_epoch()
  monkeypatch.setattr(training_tf, 'optimizer_steps', _functional)
  functional = _gan_epoch()
  assert len(fast) == len(functional)
  for a, b in zip(fast, functional):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setattr(fedcg_tf, 'PAIRED_D_PASSES', False)
  separate = _gan_epoch()
  assert len(separate) == len(functional)
  # Float rounding, but for at most one weight in 10 000, by at most one
  # Adam step (lr 3e-4): Adam's m / sqrt(v) turns the rounding of a
  # near-zero gradient into a sizeable part of a step. Seen: 2 of D's
  # 524 288 conv3 weights 1.26e-5 apart once the spectral norm's rank-one
  # terms joined the kernel gradient's product (whose sum order the paired
  # and separate passes change); with E's conv1 banded (other features,
  # other near-zero gradients) up to 8 weights of a 524 288-weight kernel
  # and 3 of a 131 072-weight one, by up to 5.3e-5. Pairing D's passes
  # wrongly moves most weights.
  for a, b in zip(functional, separate):
    off = ~np.isclose(a, b, rtol=1e-4, atol=1e-5)
    assert off.sum() <= a.size // 10_000, (a.shape, off.sum())
    np.testing.assert_allclose(a, b, rtol=0, atol=3e-4)


def test_weight_decay_is_l2_on_the_gradient_of_e_and_c():
  """`weight_decay` adds wd * w to the gradient of every weight of E and C
  (PyTorch's Adam(weight_decay=wd)): the same as minimising the loss plus
  (wd / 2) * ||w||^2 without it. A loop that dropped or halved the decay
  fails."""
  rng = np.random.default_rng(5)
  data = tf.data.Dataset.from_tensor_slices((
      rng.normal(size=(16, 32, 32, 1)).astype(np.float32),
      rng.integers(0, 10, 16).astype(np.int32))).batch(8)
  wd = 0.5

  def train(config, penalty):
    nets = training_tf.PartyNetworks(config, ('extractor', 'classifier'))
    state = fedcg_tf.initial_client_state(config, 3)
    model_weights.assign(nets.extractor, state.extractor)
    model_weights.assign(nets.classifier, state.classifier)
    variables = (nets.extractor.trainable_variables +
                 nets.classifier.trainable_variables)
    extra = None
    if penalty:
      extra = lambda *_: 0.5 * wd * tf.add_n(
          [tf.reduce_sum(tf.square(v)) for v in variables])
    tf.function(lambda: training_tf.train_classifier(
        nets, state.classification_optimizer, data, 1, extra))()
    return [v.numpy() for v in variables]

  decayed = train(FedCGConfig(weight_decay=wd), penalty=False)
  penalised = train(FedCGConfig(weight_decay=0.0), penalty=True)
  plain = train(FedCGConfig(weight_decay=0.0), penalty=False)
  for a, b in zip(decayed, penalised):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert not all(np.allclose(a, c, atol=1e-6) for a, c in zip(decayed, plain))


# Ops whose output may share its input's buffer. (Not IdentityN, which
# custom gradients put around their inputs and outputs: output i shares only
# input i's buffer, and following all its outputs flags the loss.)
_VIEWS = ('Reshape', 'Identity', 'StopGradient', 'Squeeze', 'ExpandDims',
          'Snapshot', 'Slice', 'StridedSlice', 'Split')


def _late_reads(function_def):
  """Per ResourceApplyAdam node of `function_def`: the nodes holding a read of
  its weight that are not its ancestors (so the graph lets the update run
  before them), leaving out reads ordered after the update; and how many
  nodes take its weight's handle before it (the step's reads)."""
  nodes = {n.name: n for n in function_def.node_def}
  parents = {name: {i.lstrip('^').split(':')[0] for i in n.input}
             for name, n in nodes.items()}
  children = {name: set() for name in nodes}
  consumers = {name: set() for name in nodes}  # Of a node's values.
  for name, n in nodes.items():
    for i in n.input:
      parent = i.lstrip('^').split(':')[0]
      if parent in nodes:
        children[parent].add(name)
        if not i.startswith('^'):
          consumers[parent].add(name)

  def closure(start, edges):
    seen, todo = set(), [start]
    while todo:
      for nxt in edges.get(todo.pop(), ()):
        if nxt not in seen:
          seen.add(nxt)
          todo.append(nxt)
    return seen

  late = {}
  for name, update in nodes.items():
    if update.op != 'ResourceApplyAdam':
      continue
    weight = update.input[0].split(':')[0]
    before, after = closure(name, parents), closure(name, children)
    holders, reads = set(), 0
    for other in nodes.values():
      takes = {i.split(':')[0] for i in other.input if not i.startswith('^')}
      if weight not in takes or other.name in after or other.name == name:
        continue
      reads += 1
      # A read's value lives until its consumers ran, and those of the views
      # that share its buffer (a reshaped kernel); a call or cond given the
      # handle reads inside.
      if other.op != 'ReadVariableOp':
        holders.add(other.name)
        continue
      views = [other.name]
      while views:
        for consumer in consumers[views.pop()]:
          holders.add(consumer)
          if nodes[consumer].op in _VIEWS:
            views.append(consumer)
    late[(function_def.signature.name, name)] = holders - before, reads
  return late


def test_adam_updates_wait_for_every_read_of_their_weight():
  """FusedAdamSteps updates no weight while the step still holds a read of
  it: TF would update a copy (copy on write), which made the update of G's
  deconv2 kernel 4x slower. Checked on stage 2's graph, where that read is
  the product taking the gradient on from deconv2 to deconv1."""
  config = FedCGConfig(gan_epochs=1)
  dataset = tf.data.Dataset.from_tensor_slices(
      (tf.zeros([16, 32, 32, 1]), tf.zeros([16], tf.int32))).batch(8)
  state = fedcg_tf.initial_client_state(config, 1)
  nets = fedcg_tf.PartyNetworks(config)
  graph = tf.function(lambda: fedcg_tf.train_gan(
      nets, state.discriminator_optimizer, state.generator_optimizer,
      dataset, state.seed, 0)).get_concrete_function().graph.as_graph_def()
  late = {}
  for function in graph.library.function:
    late.update(_late_reads(function))
  # D's and G's trainable weights, each updated once a step, in the function
  # that reads them for the step (else reads elsewhere would go unseen).
  assert len(late) == len(nets.discriminator.trainable_variables) + len(
      nets.generator.trainable_variables)
  assert all(reads for _, reads in late.values())
  assert not {k: v for k, (v, _) in late.items() if v}


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
