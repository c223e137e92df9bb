"""What a stalled run says it waits on (launch/waiting.py): the line built from the broker's
status and the trainer's `waiting` heartbeat, and when the launcher prints it. The line in a
real stalled run (a frozen rollout worker) is checked in tests/integration/test_chaos.py."""

from __future__ import annotations

from relax_slurm.broker.stats import BrokerStatus, Counters
from relax_slurm.launch.waiting import StallNotes, explain


def status(roles: dict, queue: int = 1, in_flight: int = 3) -> BrokerStatus:
    counters = Counters.zero()
    counters.queue_depth, counters.in_flight, counters.version = queue, in_flight, 4
    return BrokerStatus(counters=counters, max_staleness=1, batch_size=4, admission_open=True,
                        parked_acquires=0, parked_get_batch=1, auth_refused=0, uptime_s=9.0,
                        pid=1, roles=roles)


def test_a_trainer_waiting_for_a_batch_names_the_queue_and_the_busy_engines():
    line = explain(status({
        "trainer": {"heartbeat_age_s": 2.0, "step": 4,
                    "waiting": {"batch": {"version": 4, "groups": 4}}},
        "rollout": {"heartbeat_age_s": 41.0, "groups_in_flight": 3,
                    "requests_open": {"http://e0:1": 6, "http://e1:2": 0}}}))
    assert line.startswith("the trainer waits for a batch for version 4 (1 of 4 groups "
                           "queued, 3 in flight)"), line
    assert "rollout: 3 groups in flight, requests open per engine: http://e0:1 6 " \
           "(heartbeat 41s ago)" in line, line
    assert "http://e1:2" not in line  # idle engines are not named


def test_a_sync_names_the_engines_that_have_not_finished():
    line = explain(status({"trainer": {"heartbeat_age_s": 1.0, "waiting": {
        "weight_sync": {"version": 7, "engines": ["http://e1:2"]}}}}))
    assert line == ("the trainer waits for a weight sync of version 7 (not finished: "
                    "http://e1:2) (the trainer's heartbeat 1s ago)")


def test_a_silent_trainer_is_computing_and_a_missing_one_starting():
    line = explain(status({"trainer": {"heartbeat_age_s": 30.0, "step": 3, "waiting": {}}}))
    assert line.startswith("the trainer is in a step (training, exporting or checkpointing")
    assert "30s ago, at step 3" in line
    assert "has not heartbeat yet" in explain(status({}))
    assert "does not answer GET /status" in explain(None)


def test_a_rollout_worker_that_never_beat_is_said():
    line = explain(status({"trainer": {"heartbeat_age_s": 1.0,
                                       "waiting": {"batch": {"version": 0, "groups": 4}}}}))
    assert line.endswith("no rollout worker has heartbeat yet (the trainer's heartbeat 1s ago)"), \
        line


def test_stall_notes_wait_three_beats_or_two_steps_then_repeat():
    notes = StallNotes(heartbeat_interval_s=2.0)
    assert not notes.due(now=5.9, last_step_t=0.0)  # 3 x 2 s
    assert notes.due(now=6.0, last_step_t=0.0)
    assert not notes.due(now=11.9, last_step_t=0.0) and notes.due(now=12.0, last_step_t=0.0)
    notes.stepped({"perf/step_time_s": 10.0}, now=100.0)  # slow steps are not stalls
    assert not notes.due(now=119.9, last_step_t=100.0) and notes.due(now=120.0,
                                                                      last_step_t=100.0)


def test_the_workers_groups_are_said_by_phase_and_a_busy_reward_named():
    def line(phases: dict, busy: int) -> str:
        return explain(status({
            "trainer": {"heartbeat_age_s": 3.0, "waiting": {"batch": {"version": 4}}},
            "rollout": {"heartbeat_age_s": 1.0, "groups_in_flight": sum(phases.values()),
                        "groups_by_phase": phases, "requests_open": {"http://e0:1": 2},
                        "reward_workers": {"busy": busy, "workers": 4,
                                           "s_per_response": 0.2134}}}))

    slow_reward = line({"scoring": 24, "generating": 3}, busy=4)
    assert ("rollout: 27 groups in flight (24 scoring rewards, 3 generating), requests open per "
            "engine: http://e0:1 2, reward workers 4 of 4 busy (~0.21 s a response): the reward "
            "is what the batch waits on; raise reward.num_workers") in slow_reward, slow_reward
    assert slow_reward.endswith("(heartbeat 1s ago) (the trainer's heartbeat 3s ago)")
    # the engines are the slow part, or the reward has room: no advice
    assert "raise reward.num_workers" not in line({"generating": 24, "scoring": 3}, busy=4)
    assert "raise reward.num_workers" not in line({"scoring": 24, "generating": 3}, busy=2)
    # an episode's turns are counted per episode, not as groups
    assert "raise reward.num_workers" in line({"scoring": 3, "episodes": 2, "turns": 30}, busy=4)
    assert "(1 waiting on the teacher, 1 sending to the broker)" in line(
        {"teacher": 1, "sending": 1}, busy=0)


def test_episodes_with_no_model_turn_generating_wait_on_the_environment():
    def line(turns: int) -> str:
        return explain(status({
            "trainer": {"heartbeat_age_s": 3.0, "waiting": {"batch": {"version": 4}}},
            "rollout": {"heartbeat_age_s": 1.0, "groups_in_flight": 4,
                        "groups_by_phase": {"episodes": 4, "turns": turns},
                        "requests_open": {"http://e0:1": 4}}}))

    # the group holds its engine for all its turns: open requests do not tell (a run whose
    # env.step slept 3 s showed "requests open per engine: ... 32")
    assert ("rollout: 4 groups in flight (4 playing episodes), requests open per engine: "
            "http://e0:1 4, no episode's model turn generating: the episodes wait on the "
            "environment (heartbeat 1s ago)") in line(0), line(0)
    assert "environment" not in line(3)
    assert "(4 playing episodes, 3 episodes' model turns generating)" in line(3)


def test_a_full_environment_thread_pool_is_named_with_the_fix():
    def line(threads: dict) -> str:
        return explain(status({
            "trainer": {"heartbeat_age_s": 3.0, "waiting": {"batch": {"version": 4}}},
            "rollout": {"heartbeat_age_s": 1.0, "groups_in_flight": 16,
                        "groups_by_phase": {"episodes": 16}, "env_threads": threads}}))

    full = line({"threads": 64, "busy": 64, "waiting": 192})
    assert ("no engine request open, all 64 env.threads busy and 192 environment calls "
            "waiting for one: raise env.threads, or make the environment's step a coroutine "
            "(async def) (heartbeat 1s ago)") in full, full
    # room in the pool: the environment itself is slow, as before
    room = line({"threads": 64, "busy": 40, "waiting": 0})
    assert "env.threads" not in room and "the episodes wait on the environment" in room
