"""The networks: Keras builders of the LeNet-5 split (`lenet`) and the
ResNet-18 split (`resnet`), picked by name in `families`; the layers and
initialisers they share (`layers`, `small_conv`); weights as tuples of
tensors and their seeded initial draws (`model_weights`)."""
