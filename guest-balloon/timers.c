/* capsule-agent: timers shared by the main loop and long-running commands — the freeze timeout
 * and the balloon's hold time and memory-pressure check. */
#include "agent.h"

void service_timers(void)
{
    if (g_nfrozen > 0 && g_thaw_at > 0 && now_mono() >= g_thaw_at) {
        int n = g_nfrozen;
        if (thaw_all(NULL) > 0)
            g_thaw_at = now_mono() + 1; /* retry in a second */
        else
            logmsg("freeze timeout: thawed %d file system(s)", n);
    }
    balloon_tick();
}

/* Milliseconds until the next timer is due (capped at cap_ms). */
int next_timer_ms(int cap_ms)
{
    double t = now_mono(), due = t + cap_ms / 1000.0;
    if (g_nfrozen > 0 && g_thaw_at > 0 && g_thaw_at < due)
        due = g_thaw_at;
    if (g_held > 0) {
        double b = g_next_balloon_check;
        if (g_auto_deflate_at > 0 && g_auto_deflate_at < b)
            b = g_auto_deflate_at;
        if (b < due)
            due = b;
    }
    double ms = (due - t) * 1000.0;
    if (ms < 0)
        return 0;
    return (int)ms + 1;
}
