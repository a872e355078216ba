"""Where computations run: TFF's local C++ runtime with its workers always
stopped (`runtime`), clients spread over several workers (`workers`), CPU or
GPU placement (`devices`), and what a round computes (`flops`)."""
