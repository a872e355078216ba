"""Where computations run: TFF's local C++ runtime with its workers always
stopped (`runtime`), clients spread over several workers (`workers`), CPU or
GPU placement (`devices`), what a round computes (`flops`), and the
environment of a child interpreter of this repository (`child_env`)."""
