/* capsule-agent: timers shared by the main loop and long-running commands — the freeze timeout
 * and the balloon's hold time and memory-pressure check. */
#include "agent.h"

void service_timers(void)
{
    freeze_tick();
    balloon_tick();
}

/* Milliseconds until the next timer is due (capped at cap_ms). */
int next_timer_ms(int cap_ms)
{
    double t = now_mono(), due = t + cap_ms / 1000.0;
    double f = freeze_due(), b = balloon_due(); /* monotonic times are > 0; 0 is none */
    if (f > 0 && f < due)
        due = f;
    if (b > 0 && b < due)
        due = b;
    double ms = (due - t) * 1000.0;
    if (ms < 0)
        return 0;
    return (int)ms + 1;
}
