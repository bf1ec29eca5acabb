"""The RL loop's Ray side: one placement group (`placement`), the train actor group (`train_group`,
`train_actor`) and the rollout manager actor (`rollout_manager`). Everything crossing a Ray call is a
small JSON-able dict or a store URI; samples and weights never travel through Ray. See docs/ray.md."""
