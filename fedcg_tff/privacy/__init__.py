"""Privacy: gradient inversion (DLG) under each algorithm's threat model and
image-quality measures (`dlg_tf`), the Gaussian mechanism and its epsilon
(`dp`)."""
