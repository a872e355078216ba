"""Running an algorithm as a program: the driver that holds its states
(`driver`, `client_store`), the round loop with early stopping and resume
(`round_loop`, `checkpoint`), what a run writes (`run_files`; `run_record`,
without TensorFlow: run.json, finished runs, atomic writes) and the
paper's tables and charts from finished runs (`report`)."""
