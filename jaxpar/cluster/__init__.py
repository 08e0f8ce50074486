"""Running on many hosts: joining a job, heartbeats, agreed stops on preemption, the run-dir
lock, local multi-process launches and XLA flag presets."""
