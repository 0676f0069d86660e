"""The request schema every frontend shares: fields, ranges, logit bias, chat messages, template fields."""
