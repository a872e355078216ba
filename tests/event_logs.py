"""What a run's TensorBoard logs hold, read back for the tests."""

import glob

import tensorflow as tf


def steps(directory, tag: str = 'mean/val_accuracy') -> list[int]:
  """The steps of every `tag` event under `directory` (any depth), sorted:
  each round once means [1, ..., n]."""
  found = []
  for path in glob.glob(f'{directory}/**/events.out.tfevents*',
                        recursive=True):
    found += [e.step for e in tf.compat.v1.train.summary_iterator(path)
              for v in e.summary.value if v.tag == tag]
  return sorted(found)
