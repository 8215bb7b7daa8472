"""The tf.distribute programming model: context, values, variables, replica context, the strategies."""
