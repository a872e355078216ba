"""The shared round loop: best-validation bookkeeping and early stopping."""

import csv

import pytest

from fedcg_tff import experiment


class _ScriptedAlgorithm:
  """Returns preset validation/test accuracies, one pair of lists a round."""

  def __init__(self, val, test):
    self.val, self.test, self.rounds = val, test, []

  def run_round(self, round_num, train_data):
    self.rounds.append((round_num, train_data))
    self._round = round_num
    return {'server/loss': 1.0 / (round_num + 1)}

  def evaluate(self, val_data, test_data):
    return self.val[self._round], self.test[self._round]


def test_tracker_keeps_test_at_best_validation():
  t = experiment.BestTracker(2)
  assert t.update(0, [0.5, 0.6], [0.4, 0.7])
  assert t.update(1, [0.7, 0.5], [0.65, 0.9])  # client 0 improves
  assert not t.update(2, [0.7, 0.6], [0.99, 0.99])  # ties are no new best
  assert t.best_round == [1, 0]
  assert t.test_at_best == [0.65, 0.7]
  assert t.mean_test == pytest.approx(0.675)
  table = t.table()
  assert '65.00' in table and '70.00' in table and '67.50' in table


def test_run_stops_after_patience_rounds_without_a_new_best(tmp_path):
  val = [[0.1, 0.1], [0.2, 0.1], [0.2, 0.3], [0.2, 0.3], [0.2, 0.3],
         [0.2, 0.3], [0.9, 0.9]]
  test = [[0.0, 0.0], [0.5, 0.0], [0.5, 0.6], [0.1, 0.1], [0.1, 0.1],
          [0.1, 0.1], [0.9, 0.9]]
  algo = _ScriptedAlgorithm(val, test)
  lines = []
  writer = experiment.MetricsWriter(str(tmp_path))
  result = experiment.run(algo, train_data_fn=lambda r: [f'data{r}'],
                          val_data=[None, None], test_data=[None, None],
                          max_rounds=7, patience=3, writer=writer,
                          log=lines.append)
  assert result.stopped_early and result.rounds_run == 6
  assert [r for r, _ in algo.rounds] == list(range(6))
  assert algo.rounds[4][1] == ['data4']
  assert result.tracker.test_at_best == [0.5, 0.6]
  assert len(lines) == 6 and lines[0].startswith('round 1/7')
  assert 'ETA' in lines[-1] and '3/3 rounds without a new best' in lines[-1]
  with open(tmp_path / 'metrics.csv') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['round']) for r in rows] == list(range(1, 7))  # 1-based
  assert result.tracker.best_round == [2, 3]
  assert float(rows[2]['client_1/val_accuracy']) == pytest.approx(0.3)
  assert float(rows[2]['mean/test_accuracy_at_best_val']) == pytest.approx(0.55)
  assert float(rows[1]['server/loss']) == pytest.approx(0.5)


def test_run_without_early_stop_runs_max_rounds():
  algo = _ScriptedAlgorithm([[0.1 * r] for r in range(4)],
                            [[0.1 * r] for r in range(4)])
  result = experiment.run(algo, lambda r: [], [None], [None], max_rounds=4,
                          patience=2, log=lambda _: None)
  assert not result.stopped_early and result.rounds_run == 4
  assert len(result.round_seconds) == 4


def test_prepare_output_dir_refuses_existing_results(tmp_path):
  (tmp_path / 'metrics.csv').write_text('round\n0\n')
  with pytest.raises(FileExistsError, match='--output_dir'):
    experiment.prepare_output_dir(str(tmp_path))
  assert (tmp_path / 'metrics.csv').read_text() == 'round\n0\n'
  new = tmp_path / 'new'
  experiment.prepare_output_dir(str(new))
  assert new.is_dir()


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
